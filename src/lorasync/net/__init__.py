"""Networks: emulated clusters (namespaces, shaped links), probe, doctor, tuning."""
