"""Code shared by the api, worker and sweeper processes: config, database
access (the only place that runs SQL), logging and the job vocabulary."""
