"""Writing commits: cutting files into chunks, storing them in batches, recording the commit,
background commits and the hooks integrations join."""
