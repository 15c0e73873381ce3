"""NumPy twins (never imports opscope_nb)."""
