"""The HTTP edge: HTTP/3, HTTP/2 and HTTP/1.1 <-> ASGI on one port number (``server``), the role apps (routes
only, translating; ``*_app``) and their asyncio services (``controller_service``, ``instance_service`` and its
parts), the authorization middleware (``authz``), and the one typed KVSP API client (``api`` over ``client``).
"""
