"""tensor"""
