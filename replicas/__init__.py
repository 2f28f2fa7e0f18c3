"""prefixgate on Ray Serve: N engine replicas behind one OpenAI endpoint (`--replicas N`).

Only this package imports ray; the single-process server never does (ray is the optional
extra `prefixgate[ray]`). See docs/deploy.md.
"""
