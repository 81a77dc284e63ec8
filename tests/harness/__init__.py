"""keras_mp's differential harness: seeded user programs, run under a low-precision setup
and again in float32, and an oracle that classifies each outcome (see README in FINDINGS.md).

`programs` generates and runs programs, `oracle` classifies them, `sweep` is the command
line, `test_generated` the CI sample and the `-m slow` sweep.
"""
