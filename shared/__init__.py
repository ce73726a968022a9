"""Code the api, worker and sweeper processes share (the user-side tools in
tools/ use it too): configuration, connections, migrations and the named
queries, logging, keys, and the job vocabulary."""
