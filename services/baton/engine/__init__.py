"""The inference engine shared by prefill and decode pods (docs/design.md §4)."""
