"""The inference engine shared by prefill and decode pods (DESIGN.md §4)."""
