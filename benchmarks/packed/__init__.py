"""Packed documents: the balanced layout against zigzag, end to end and at the plan level."""
