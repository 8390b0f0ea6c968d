"""Generation engines: the protocol, the in-process, local-process and server engines, weights, and the completions server."""
