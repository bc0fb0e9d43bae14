"""The OpenAI-compatible front end: ``/v1/completions`` and ``/v1/chat/completions`` (``openai_routes``, ``params``,
``text``) over KVSP sessions placed by the Placement Controller (``session``), with its own authentication
(``auth``) and OpenAI's error shape (``errors``); ``app`` builds the ASGI app.
"""
