"""Code the api, worker and sweeper processes share (the user-side tools in
tools/ use it too): configuration, connections and migrations, the data
layer's core (the named queries of sql/*.sql, the row types, the queries
several callers run) and the operators' store the console and the CLI both
read, logging, keys, and the job vocabulary."""
