"""The control plane: catalog, placement, reconciler, fleet, accountant, the controller's sockets and admin API.

Imported by: `controller.py` (and, for the accountant alone, `gateway.py` when
no controller is followed).
Concurrency: threads. One loop owns the agents' ROUTER and the gateways'
sockets; the admin API, the accountant and the scheduler run in threads of
their own and hand what they want sent to that loop.
May import: the top-level modules, `wire` and `people` (node keys, limits and
usage in the store). Never `gateway`, `web`, `node`, `mirror` or `cli`, and
never gevent.
"""
