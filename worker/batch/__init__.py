"""The batch lane: stories sent to the provider's Message Batches API at
half the price, within the day. ``lane`` is the loop, which runs its parts
in order (``reconciler``, ``collector``, ``submitter``) under the lease;
``store`` its statements. ``provider`` is the seam the lane talks through
(create, retrieve, list, results, cancel, delete), with what crosses it in
``provider_structs``; ``anthropic_batches`` implements it over the official
SDK (its answers read by ``anthropic_reading``), ``offline_batches`` in
process memory for running without a key."""
