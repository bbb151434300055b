"""`kvyard bench …`: each benchmark measures its baseline or peer in the same run.

This machine is shared and noisy, so reports lead with ratios; absolute
numbers are printed for orientation only.
"""
