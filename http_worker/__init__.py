"""The OpenAI-compatible HTTP frontend role: ``protocol`` (request models and response bodies),
``frontend`` (one process's shared state), ``generation`` (the engine requests behind one HTTP
request), ``app`` (routes), ``metrics`` and ``server`` (the process)."""
