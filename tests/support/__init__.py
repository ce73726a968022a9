"""What the tests share, one module per kind of thing:

- ``settings``: each process's settings with the tests' fast timings
- ``database``: rows written and read straight in the tables, keys, counts
- ``waiting``: ``wait_until``, the one way a test waits for a condition
- ``workers``: a worker coordinator running in the test's event loop
- ``host``: the repository's path, a free port
- ``outcome``: whether a fixture's test failed (to show logs)
- ``postgres_server``: where the tests' Postgres comes from; databases on it
- ``pgbouncer``: a real PgBouncer in front of it
- ``api_client``: the api in the test's event loop, problem answers
- ``ops_seed``: jobs in every state, for the operators' console

Stand-ins for what storyjobs talks to (the provider, a webhook receiver, the
worker's store) are in ``tests/fakes``.
"""
