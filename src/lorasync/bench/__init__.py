"""The ``lorasync bench`` machinery: sync strategies measured on emulated links."""
