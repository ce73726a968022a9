"""The schema migrations (NNN_name.sql) and the named runtime queries
(queries.sql), shipped as package data so an installed storyjobs finds them."""
