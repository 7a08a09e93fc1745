"""How the services run together: the local launcher (`relay up`), Dockerfiles, Kubernetes manifests."""
