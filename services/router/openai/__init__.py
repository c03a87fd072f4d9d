"""The router's OpenAI-compatible HTTP API: the second door into the same request path.

``protocol`` parses and checks the request bodies, ``requests`` turns them into the router's
``GenerateRequest``s, ``choices`` runs them through ``RouterServicer.generate`` (the code path
of gRPC ``Generate``), ``responses`` shapes OpenAI's JSON and SSE chunks, ``errors`` its error
bodies, ``routes`` serves them with FastAPI and ``server`` runs uvicorn in the router's loop.
"""
