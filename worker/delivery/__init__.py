"""Webhook deliveries, run in the worker process beside the job loop
(worker/__main__.py starts both): ``loop`` claims due deliveries from the
outbox and records each attempt, ``send`` makes the one HTTP request without
letting it reach an address it must not, ``metrics`` counts them."""
