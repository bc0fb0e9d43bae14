"""KVSP over HTTP, the server side: the role apps (routes only, translating HTTP to the roles and their runtimes:
``index_app``, ``holder_app``, ``controller_app``, ``instance_app``, ``relay_app``, ``metrics_app``), the app kit
(``app_kit``), the authorization middleware (``authz``) and the one problem+json rendering (``problem_response``).
ASGI apps, served by ``http3.server``.
"""
