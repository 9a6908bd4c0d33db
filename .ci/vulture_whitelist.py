"""Names `vulture fleetrl .ci/vulture_whitelist.py --min-confidence 80` reports that are used after all.

Each entry says who uses it. Add an entry only for a real use vulture cannot see, never to silence dead code.
"""
# fleetrl/cluster/up.py `_stop`: the signal module calls a handler with (signum, frame).
signum
frame
