"""kvyard: a Kubernetes-native control plane for disaggregated LLM inference."""
__version__ = "0.1.0"
