"""Named mutants: small textual changes to the code, each attacking one
invariant, applied one at a time in a scratch copy of the repository and run
against the tests that should notice (``make mutants``)."""
