"""What several test modules share, so that no test module imports another (tests/test_layering.py checks it).

One module per area: the constants, builders and small worlds the tests of that area have in common
(``tests.support.index``: index records and principals; ``tests.support.cluster``: blocks for real ``kvsp-quic``
processes; ``tests.support.moqt_relay``: relay worlds; ``tests.support.instance``: the instance cluster; ...).
The fixtures several modules share are in tests/conftest.py, found by name; tests/helpers.py, tests/pki.py,
tests/asgi.py, tests/peers.py, tests/redis_server.py and tests/vectors.py are the older shared modules.
"""
