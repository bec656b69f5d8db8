"""expert"""
