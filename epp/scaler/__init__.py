"""KEDA's external scaler served by the EPP: its metadata, metric and measured capacity."""
