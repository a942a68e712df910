"""Train while it stages: the streaming protocol, the stager process, and the caller's handle.

``protocol`` (the files in ``incoming/stream/`` that readers and the stager share, and the READY rule) ->
``process`` (the detached streaming stager) driven by ``schedule`` (pure: what to copy next, what to evict)
and ``eviction`` (pure: the victim rule under a cache limit); ``handle`` starts a stager and holds it
(``stage(wait=False)``: ``StreamHandle``).
"""
