"""Pieces shared by preprocessing and trainer."""
