"""trims.evaluation"""
