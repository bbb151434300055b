"""The gateway: Envoy in front, the EPP choosing over ext_proc.

`config` renders the Envoy bootstrap, `envoy` finds and launches the binary,
`cli` is `kvyard gateway-config`.
"""
