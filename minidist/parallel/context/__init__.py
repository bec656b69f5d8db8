"""context"""
