"""The batch lane: stories sent to the provider's Message Batches API at
half the price, within the day. ``provider`` is the seam the lane talks
through (create, retrieve, list, results, cancel, delete), with what it
returns and raises; ``anthropic_batches`` implements it over the official
SDK, ``offline_batches`` in process memory for running without a key."""
