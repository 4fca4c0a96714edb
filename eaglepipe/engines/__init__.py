"""Engines that run the target model behind one interface (base.py)."""
