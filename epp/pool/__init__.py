"""The live endpoint pool and what keeps it current: discovery (file, Kubernetes) and scraping."""
