"""trims.runtime"""
