"""The KVSP client: the one typed API client (``api.KvspApi``: records on both sides of the wire, failover between
URIs, the failure vocabulary) and verified block retrieval (``retrieval``: replicas tried in order, layer by layer,
digests checked, over HTTP/3 or HTTP/1.1; ``retrieval_sink``, ``producer_digests``). Used by the role runtimes, the
front end, KVSP over MOQT and the interop matrix; it imports the HTTP stack (``http3``) and the core.
"""
