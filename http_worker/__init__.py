"""The OpenAI-compatible HTTP frontend role: ``body`` (reading, parsing and validating every
request body: the field policy's HTTP edge), ``protocol`` (request models and response bodies),
``openapi`` (the /openapi.json document), ``frontend`` (one process's shared state),
``generation`` (the engine requests behind one HTTP request), ``app`` (routes), ``metrics`` and
``worker`` (the process)."""
