# One image for every command of the project: stargate, pylon, stargate-mock-engine, stargate-bench.
#   docker build -t stargate-router:0.1.0 .
#   docker run --rm stargate-router:0.1.0 stargate --help
FROM python:3.12-slim AS build
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install --no-cache-dir --prefix=/install .

FROM python:3.12-slim
COPY --from=build /install /usr/local
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
# Numeric so that Kubernetes' runAsNonRoot can verify it.
USER 10001:10001
EXPOSE 8000 50071 50073 9090
CMD ["stargate", "--help"]
