"""A study's chosen configuration deployed as a Ray Serve LLM application and measured through
Serve's OpenAI ingress: replicas, the router's overhead against the bare engine, and scaling.

``plan`` is pure (what to deploy, what it needs, the scaling rows); ``cluster`` talks to Ray and
Serve; ``check`` drives one replica count after another with ``load/`` and ``trial/measure``.
"""
