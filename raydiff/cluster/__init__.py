"""raydiff and the Ray cluster: starting or joining Ray (`start`), the nodes a run trains on (`nodes`), shared
storage (`storage`), the cluster files checked before launch (`files`)."""
