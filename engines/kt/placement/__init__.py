"""Placement: the rule files' format and matching, the alias table for KTransformers' names, and the operators rules
put in place."""
