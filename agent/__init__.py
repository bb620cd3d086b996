"""The rank library: a rank's manifest, join client, torchrun glue, audits and digests.

Its public names are re-exported by `cohortgate` (`cohortgate.join`, ...); nothing here is loaded
until used.
"""
