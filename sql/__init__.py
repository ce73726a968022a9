"""The schema migrations (NNN_name.sql) and the named runtime queries, one
file per caller over a common core (common.sql, api.sql, worker.sql,
sweeper.sql, console.sql), shipped as package data so an installed storyjobs
finds them."""
