"""Using what a run trained: `Classifier`, the merged export, the CPU int8 path, and the HTTP server."""
