"""One request model per inference endpoint (:mod:`.spec` is the machinery).

Each model declares every field its endpoint honours, refuses or ignores once; the validation, the
field table (:mod:`swarmkit.server.fields`), the request bodies of the OpenAPI document
(:mod:`swarmkit.server.openapi`) and the translation into the engine's ``SamplingParams`` come from it.
"""
