"""The role runtimes: the asyncio services that carry out the roles' decisions (requests, tasks, locks, timers), with
no HTTP code of their own: the Placement Controller (``controller_service``, ``controller_link``, ``controller_maps``),
the Inference Instance (``instance_service``, ``instance_blocks``, ``instance_runs``, ``instance_reshard``) and the
holder's publisher (``publisher``). The rules are the roles' (``kvsp_quic.roles``); requests go through
``kvsp_client``.
"""
