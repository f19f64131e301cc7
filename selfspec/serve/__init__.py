"""The OpenAI-compatible server: routes, the wire schema, metrics and Ray Serve replicas."""
