"""keras_mp's differential harness: seeded user programs, run under a low-precision setup
and again in float32, and an oracle that classifies each outcome (FINDINGS.md: how to run
it, the calibration, and what it found).

`programs` draws a `Program` and runs it (`families`: each family's data and model;
`loops`: the guides' own training loops), `oracle` classifies, `sweep` is the command line,
`test_generated` the CI sample and the `-m slow` sweep.
"""
