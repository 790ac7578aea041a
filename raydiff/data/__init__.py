"""Data: storage filesystems, sources, decoding, Ray Data ingest, the global sample order and worker batches."""
