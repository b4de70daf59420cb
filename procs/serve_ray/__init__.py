"""splitserve as a Ray Serve application (docs/ray.md): engine replicas, each a small splitserve
cluster of its own, behind an OpenAI-compatible ingress that tokenizes and hashes, routed by the
token-prefix score of ``ipc.replica_router``. A launcher beside ``procs``' supervisor: nothing below
imports it, and only it imports ``ray`` (the optional ``ray`` extra).

Modules: ``settings`` (the knobs), ``calls`` (what goes between the deployments), ``engine``
(an engine replica, also a prefill or decode one), ``handover`` (such a replica's line to its
engine), ``client`` and ``ingress`` (the HTTP ingress and its tokenizing client),
``router`` (the Serve request router), ``app`` (``build_app``), ``command``
(``splitserve serve-ray``).
"""
