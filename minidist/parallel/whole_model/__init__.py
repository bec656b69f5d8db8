"""whole_model"""
